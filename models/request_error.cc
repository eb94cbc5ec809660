// Structured request errors (see request_error.h).
#include "models/request_error.h"

#include <optional>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace mita::models {
namespace {

// The payload's type URL and its encoding: per problem "<field>,<index>,<detail length>:<detail>".
constexpr char kPayloadUrl[] = "type.mita-serve/mita.models.FieldProblems";

std::string Encode(const std::vector<FieldProblem>& problems) {
  std::string out;
  for (const FieldProblem& problem : problems) {
    absl::StrAppend(&out, static_cast<int>(problem.field), ",", problem.index, ",", problem.detail.size(), ":",
                    problem.detail);
  }
  return out;
}

// Reads the integer in `text` from `*position` up to `delimiter`; false when there is none.
bool ReadNumber(absl::string_view text, size_t* position, char delimiter, int64_t* value) {
  const size_t end = text.find(delimiter, *position);
  if (end == absl::string_view::npos) return false;
  if (!absl::SimpleAtoi(text.substr(*position, end - *position), value)) return false;
  *position = end + 1;
  return true;
}

std::vector<FieldProblem> Decode(absl::string_view text) {
  std::vector<FieldProblem> problems;
  size_t position = 0;
  while (position < text.size()) {
    int64_t field = 0, index = 0, length = 0;
    if (!ReadNumber(text, &position, ',', &field) || !ReadNumber(text, &position, ',', &index) ||
        !ReadNumber(text, &position, ':', &length) || length < 0 ||
        static_cast<size_t>(length) > text.size() - position) {
      return {};  // not ours: a payload under our URL that does not parse carries no problems
    }
    problems.push_back({static_cast<RequestField>(field), index, std::string(text.substr(position, length))});
    position += static_cast<size_t>(length);
  }
  return problems;
}

}  // namespace

const char* RequestFieldName(RequestField field) {
  switch (field) {
    case RequestField::kModel:
      return "model";
    case RequestField::kModelVersion:
      return "model_version";
    case RequestField::kInput:
      return "input";
    case RequestField::kImage:
      return "image";
    case RequestField::kDocument:
      return "document";
    case RequestField::kDocumentText:
      return "document text";
    case RequestField::kDocumentTokenIds:
      return "document token ids";
    case RequestField::kBudget:
      return "budget";
    case RequestField::kExperts:
      return "experts";
    case RequestField::kExpertCount:
      return "expert_count";
    case RequestField::kExpertWidth:
      return "expert_width";
    case RequestField::kPreset:
      return "preset";
    case RequestField::kTopN:
      return "top_n";
    case RequestField::kTruncate:
      return "truncate";
    case RequestField::kLatencyTarget:
      return "latency target";
    case RequestField::kBudgetFloor:
      return "budget floor";
  }
  return "request";
}

namespace {

std::string NeutralWording(const FieldProblem& problem) {
  return absl::StrCat(RequestFieldName(problem.field),
                      problem.index >= 0 ? absl::StrCat("[", problem.index, "]") : "", ": ", problem.detail);
}

}  // namespace

std::ostream& operator<<(std::ostream& out, const FieldProblem& problem) { return out << NeutralWording(problem); }

absl::Status InvalidRequest(std::vector<FieldProblem> problems) {
  std::string message;
  for (const FieldProblem& problem : problems) {
    if (!message.empty()) message += "; ";
    message += NeutralWording(problem);
  }
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kPayloadUrl, absl::Cord(Encode(problems)));
  return status;
}

absl::Status InvalidRequest(RequestField field, std::string detail, int64_t index) {
  return InvalidRequest(std::vector<FieldProblem>{{field, index, std::move(detail)}});
}

std::vector<FieldProblem> FieldProblems(const absl::Status& status) {
  if (status.ok()) return {};
  const auto payload = status.GetPayload(kPayloadUrl);
  if (!payload.has_value()) return {};
  return Decode(std::string(*payload));
}

}  // namespace mita::models
