// Structured errors about a request's parts. models/ checks budgets and inputs but knows no API: it reports
// which part of the request is wrong (a RequestField), the element index where one applies, and what is wrong
// and allowed in neutral words ("51 is out of range: allowed [1, 50]"). Each front end (server/) words the part
// in its own vocabulary: mita.v1 "field budget.experts.expert_width: ...", the Open Inference Protocol
// "parameter mita_expert_width: ...".
//
// The problems travel inside an absl::Status (INVALID_ARGUMENT) as a payload, so they pass through every layer
// that only forwards statuses; the status's own message words them neutrally (for logs and tools).
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace mita::models {

// The parts of a classification request, in the terms of the neutral request (server/engine/inference_request.h).
enum class RequestField {
  kModel,             // the model name
  kModelVersion,      // the model version
  kInput,             // which input the request carries (an image, a document, or none)
  kImage,             // the encoded image
  kDocument,          // the document as a whole (neither text nor token ids)
  kDocumentText,      // the document's UTF-8 text
  kDocumentTokenIds,  // the document's token ids (index: the position of the bad id)
  kBudget,            // the budget as a whole
  kExperts,           // the expert budget (expert count and width together)
  kExpertCount,       // expert count m
  kExpertWidth,       // expert width k
  kPreset,            // a named budget
  kTopN,              // how many classes to return
  kTruncate,          // whether a long document may be cut
  kLatencyTarget,     // the latency target (time from receipt to answer)
  kBudgetFloor,       // the least accurate budget a latency target allows
};

// A neutral name of `field` for logs and tools ("expert_width", "document text", ...).
const char* RequestFieldName(RequestField field);

// One problem with one part of a request.
struct FieldProblem {
  RequestField field = RequestField::kInput;
  // Element of a repeated part (e.g. the position of a token id); -1 when the whole part is meant.
  int64_t index = -1;
  // What is wrong and what is allowed, without the part's name, e.g. "51 is out of range: allowed [1, 50]".
  std::string detail;

  bool operator==(const FieldProblem& other) const {
    return field == other.field && index == other.index && detail == other.detail;
  }
};

// "<neutral name>[index]: <detail>", for logs and test failures.
std::ostream& operator<<(std::ostream& out, const FieldProblem& problem);

// INVALID_ARGUMENT carrying `problems` (at least one). Its message joins "<neutral name>[index]: <detail>" with
// "; ".
absl::Status InvalidRequest(std::vector<FieldProblem> problems);
absl::Status InvalidRequest(RequestField field, std::string detail, int64_t index = -1);

// The problems `status` carries (InvalidRequest), in order; empty for any other status.
std::vector<FieldProblem> FieldProblems(const absl::Status& status);

// Words `status` for a front end: when it carries problems, a status of the same code whose message joins
// "<subject>: <detail>" with "; ", where `subject(problem)` names the part in the front end's vocabulary; any
// other status is returned unchanged.
template <typename SubjectFunction>
absl::Status WordProblems(const absl::Status& status, SubjectFunction subject) {
  std::vector<FieldProblem> problems = FieldProblems(status);
  if (problems.empty()) return status;
  std::string message;
  for (const FieldProblem& problem : problems) {
    if (!message.empty()) message += "; ";
    message += subject(problem);
    message += ": ";
    message += problem.detail;
  }
  return absl::Status(status.code(), message);
}

}  // namespace mita::models
