# Sourced by the bench scripts.

# wait_for_server_port LOG [TRIES]: prints the gRPC port from mita-server's
# "serving gRPC ... (port N;" log line in LOG once it appears, checking every 0.1 s up to TRIES times (600);
# prints nothing when it never appears.
wait_for_server_port() {
  local log="$1" tries="${2:-600}" port=""
  for _ in $(seq 1 "$tries"); do
    port="$(sed -n 's/.*serving gRPC.* (port \([0-9]*\);.*/\1/p' "$log")"
    [ -n "$port" ] && break
    sleep 0.1
  done
  echo "$port"
}

# stop_server PID: sends mita-server PID SIGTERM and waits until it has drained and exited; nothing when PID is empty
# or the process is gone (for the scripts' exit traps).
stop_server() {
  [ -n "$1" ] || return 0
  kill -TERM "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

# start_bench_work: makes the temporary folder $work and sets server_pid=""; at exit, stops the server whose PID the
# script left in $server_pid (stop_server) and removes $work.
start_bench_work() {
  work="$(mktemp -d)"
  server_pid=""
  trap 'stop_server "$server_pid"; rm -rf "$work"' EXIT
}
