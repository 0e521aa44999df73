#!/bin/sh
# tests/probes/run.sh NAME [STEPS ROWS...]: one probe, the noise filtered out.
cd "$(dirname "$0")/../.." && TF_CPP_MIN_LOG_LEVEL=2 timeout 300 \
  .venv/bin/python tests/probes/probe.py drive "$@" 2>&1 |
  grep -v '^WARNING\|^W0\|^I0\|deprecat\|^  [^ ]\|cuda\|^20..-' | tail -30
