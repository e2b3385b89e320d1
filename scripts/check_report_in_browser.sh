#!/usr/bin/env bash
# Check that `sb3-influence report` renders in a real headless browser.
#
# Usage: scripts/check_report_in_browser.sh [RUN_DIR] [SCREENSHOT.png]
#   RUN_DIR     a folder with attribution snapshots; default: a tiny IIF run on CartPole made here (about 20 s)
#   SCREENSHOT  where the screenshot goes; default: /tmp/sb3_influence_report.png
# Installs Debian's chromium with apt-get when no chromium is found (needs root), builds the report, and takes a
# full-page screenshot with chromium --headless. Open the PNG to look at it; the script fails if chromium fails
# or the screenshot is missing. tests/test_report.py::test_report_renders_in_headless_chromium does the same
# automatically whenever chromium is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export MPLBACKEND=Agg
screenshot="${2:-/tmp/sb3_influence_report.png}"

browser="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$browser" ]; then
    echo "installing chromium (apt-get)..."
    DEBIAN_FRONTEND=noninteractive apt-get install -y chromium >/dev/null
    browser="$(command -v chromium)"
fi

run_dir="${1:-}"
if [ -z "$run_dir" ]; then
    run_dir="$(mktemp -d)/run"
    python - "$run_dir" <<'PY'
import sys

from stable_baselines3.common.env_util import make_vec_env

from sb3_influence import AttributionCallback, IIFCallback, InfluencePPO

run_dir = sys.argv[1]
env = make_vec_env("CartPole-v1", n_envs=2, seed=0, monitor_dir=f"{run_dir}/monitor")
model = InfluencePPO("MlpPolicy", env, n_steps=128, batch_size=64, n_epochs=4, seed=0)
model.learn(128 * 2 * 8, callback=[IIFCallback(fraction=0.5), AttributionCallback(save_dir=f"{run_dir}/snapshots")])
PY
fi

out_dir="$(mktemp -d)"
sb3-influence report "$run_dir" --out "$out_dir"
profile="$(mktemp -d)"
"$browser" --headless --no-sandbox --disable-gpu --disable-background-networking --user-data-dir="$profile" \
    --window-size=1200,4200 --screenshot="$screenshot" "file://$out_dir/report.html" 2>/dev/null
test -s "$screenshot"
echo "report: $out_dir/report.html"
echo "screenshot: $screenshot"
