#!/usr/bin/env bash
# The main job: install into ./.venv, then serve MODEL (default: the embedded demo model,
# trained locally on first use) with CSV-Decode on and show one answered request.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_env.sh
exec .venv/bin/vllm-csv serve "$@"
