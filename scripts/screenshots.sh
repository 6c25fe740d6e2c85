#!/usr/bin/env bash
# Screenshots of the UIs on a demo's stores, taken in headless Chromium, to check what a user sees:
# the MLflow runs table (Models and Datasets columns), the policy's LoggedModel page, its registry
# version, the judged prompts as traces and the evaluate run's assessment summary (each pairing's
# win rate), and the Prefect UI started on a non-default port with the command the demo prints (the
# script also checks that this UI is told the API's real port).
#
# Usage: scripts/screenshots.sh [DEMO_HOME] [OUT_DIR]
#   DEMO_HOME  a demo home with runs in it (default .rloo-demo; e.g. after `python -m flows.demo --smoke --home DIR`)
#   OUT_DIR    where the PNGs go (default /tmp/rloo-screenshots)
#   MLFLOW_PORT / PREFECT_PORT  UI ports (default 5055 / 4255: not the defaults, on purpose)
#   WINDOW_SIZE                 browser window, e.g. 1800,600
# Needs chromium (Debian: apt-get install -y chromium). Both UIs are stopped when the script ends.
set -euo pipefail
cd "$(dirname "$0")/.."
home="$(realpath "${1:-.rloo-demo}")"
out="${2:-/tmp/rloo-screenshots}"
mlflow_port="${MLFLOW_PORT:-5055}"
prefect_port="${PREFECT_PORT:-4255}"
venv="${RLOO_VENV:-.venv}"
chromium="$(command -v chromium || command -v chromium-browser || true)"
[ -n "$chromium" ] || { echo "screenshots: chromium not found (apt-get install -y chromium)" >&2; exit 1; }
[ -f "$home/mlflow.db" ] || { echo "screenshots: $home/mlflow.db not found; run the demo first" >&2; exit 1; }
mkdir -p "$out"
logs="$(mktemp -d)"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 2
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

start() {  # name, command...: in its own session (its process group is killed at the end)
  local name="$1"; shift
  setsid bash -c 'echo $$ > "$0"; exec "$@"' "$logs/$name.pid" "$@" >"$logs/$name.log" 2>&1 &
  for _ in $(seq 1 50); do [ -s "$logs/$name.pid" ] && break; sleep 0.1; done
  pids+=("$(cat "$logs/$name.pid")")
}
# The commands the demo prints (flows/demo.py render_summary), with the ports changed as it says.
start mlflow "$venv/bin/mlflow" ui --backend-store-uri "sqlite:///$home/mlflow.db" --port "$mlflow_port"
start prefect env PREFECT_HOME="$home/prefect" \
  PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///$home/prefect/prefect.db" \
  PREFECT_SERVER_API_PORT="$prefect_port" "$venv/bin/prefect" server start

wait_for() {  # url, name, log
  for _ in $(seq 1 180); do
    if curl -fsS -o /dev/null "$1" 2>/dev/null; then return 0; fi
    sleep 1
  done
  echo "screenshots: $2 did not answer at $1; its log:" >&2
  tail -20 "$3" >&2
  exit 1
}
wait_for "http://127.0.0.1:$mlflow_port/health" "MLflow UI" "$logs/mlflow.log"
wait_for "http://127.0.0.1:$prefect_port/api/health" "Prefect server" "$logs/prefect.log"

# The demo experiment, its newest pipeline run, and the registered policy's LoggedModel.
read -r exp_id model_id model_name model_version < <(MLFLOW_TRACKING_URI="sqlite:///$home/mlflow.db" \
  "$venv/bin/python" - <<'PY' 2>/dev/null
from mlflow import MlflowClient

c = MlflowClient()
exp = c.get_experiment_by_name("rloo-demo")
name = "rloo-demo-policy"
versions = c.search_model_versions(f"name = '{name}'", order_by=["version_number DESC"], max_results=1)
v = versions[0] if versions else None
print(exp.experiment_id, v.source.removeprefix("models:/") if v else "-", name, v.version if v else "-")
PY
)
# The newest evaluate run, whose Traces tab holds one trace per judged prompt.
eval_run_id="$(MLFLOW_TRACKING_URI="sqlite:///$home/mlflow.db" "$venv/bin/python" - "$exp_id" <<'PY' 2>/dev/null
import sys
from mlflow import MlflowClient

c = MlflowClient()
runs = c.search_runs([sys.argv[1]], "tags.`mlflow.runName` = 'evaluate'", order_by=["start_time DESC"], max_results=1)
judged = c.search_traces(locations=[sys.argv[1]], run_id=runs[0].info.run_id, filter_string="tags.identical = 'false'",
                         max_results=1, include_spans=False) if runs else []
print(runs[0].info.run_id if runs else "-", judged[0].info.trace_id if judged else "-")
PY
)"
read -r eval_run_id judged_trace_id <<<"$eval_run_id"

shot() {  # name, url [virtual time budget in ms]: pages that need no clicks
  "$chromium" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$(mktemp -d)" --window-size=${WINDOW_SIZE:-1800,600} \
    --virtual-time-budget="${3:-15000}" --screenshot="$out/$1.png" "$2" >/dev/null 2>&1 || true
  if [ -s "$out/$1.png" ]; then echo "screenshots: $out/$1.png  <- $2"; else echo "screenshots: FAILED $1 <- $2" >&2; fi
}
mlflow="http://127.0.0.1:$mlflow_port"
# The runs table with the pipeline run unfolded (its expander clicked over the DevTools protocol):
# the Datasets column on the parent, train and evaluate rows, the Models column on the train row.
"$venv/bin/python" scripts/cdp_screenshot.py "$mlflow/#/experiments/$exp_id/runs" "$out/mlflow-runs.png" \
  --click ".ag-row button.du-bois-light-btn-link" --size "${WINDOW_SIZE:-1800,600}" \
  && echo "screenshots: $out/mlflow-runs.png  <- $mlflow/#/experiments/$exp_id/runs (parent run unfolded)"
if [ "$model_id" != "-" ]; then
  shot mlflow-logged-model "$mlflow/#/experiments/$exp_id/models/$model_id"
  shot mlflow-model-version "$mlflow/#/models/$model_name/versions/$model_version"
fi
if [ "$eval_run_id" != "-" ]; then  # the judged prompts as traces, and one of them with its verdict feedback
  "$venv/bin/python" scripts/cdp_screenshot.py "$mlflow/#/experiments/$exp_id/traces" \
    "$out/mlflow-judgment-traces.png" --wait-text "verdict_ab" --wait 4 --size "${WINDOW_SIZE:-1800,700}" \
    --click-text "Got it" && echo "screenshots: $out/mlflow-judgment-traces.png  <- the judged prompts as traces"
  "$venv/bin/python" scripts/cdp_screenshot.py "$mlflow/#/experiments/$exp_id/traces?selectedEvaluationId=$judged_trace_id" \
    "$out/mlflow-judgment-trace.png" --wait-text "verdict_ab" --wait 4 --size 1800,900 --click-text "Got it" \
    --click-text "Assess" && echo "screenshots: $out/mlflow-judgment-trace.png  <- trace $judged_trace_id, its feedback open"
  # The evaluate run's Traces tab: its assessment summary, where the AVG of each `<a>_wins_vs_<b>` feedback is
  # that pairing's win rate. The assistant panel and the sidebar are closed to fit the feedback names unshortened.
  "$venv/bin/python" scripts/cdp_screenshot.py "$mlflow/#/experiments/$exp_id/runs/$eval_run_id/traces" \
    "$out/mlflow-evaluation-summary.png" --wait-text "_wins_vs_" --wait 4 --size 2200,600 \
    --click 'button[aria-label="Close"]' --click 'button[aria-label="Toggle sidebar"]' \
    && echo "screenshots: $out/mlflow-evaluation-summary.png  <- the evaluate run's summary: each pairing's win rate"
fi
# The Prefect UI asks its server where the API is; on a non-default port it must not say :4200.
ui_api="$(curl -fsS "http://127.0.0.1:$prefect_port/ui-settings")"
case "$ui_api" in
  *"\"api_url\":\"http://127.0.0.1:$prefect_port/api\""*) echo "screenshots: Prefect UI calls the API on :$prefect_port" ;;
  *) echo "screenshots: the Prefect UI would call the wrong API: $ui_api" >&2; exit 1 ;;
esac
"$venv/bin/python" scripts/cdp_screenshot.py "http://127.0.0.1:$prefect_port/runs" "$out/prefect-runs.png" \
  --wait-text "rlhf-pipeline" --wait 4 --size "${PREFECT_WINDOW_SIZE:-1600,900}" \
  && echo "screenshots: $out/prefect-runs.png  <- http://127.0.0.1:$prefect_port/runs"
