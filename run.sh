#!/usr/bin/env bash
# Sets up .venv with a supported Python and runs the main job or the tests.
#
#   ./run.sh main [flags]   python -m trainer.task: train the default model on
#                           the embedded digits data on 2 virtual CPU towers
#   ./run.sh test [args]    run the test suite (args go to pytest)
#
# tf.estimator exists only up to TensorFlow 2.15, which needs Python 3.9-3.11.
# Set PYTHON=/path/to/python3.x to choose the interpreter.
set -euo pipefail
cd "$(dirname "$0")"

supported() {
  "$1" -c 'import sys; sys.exit(not (3, 9) <= sys.version_info[:2] <= (3, 11))' \
    2>/dev/null
}

find_python() {
  local candidate
  for candidate in ${PYTHON:-} python3.11 python3.10 python3.9 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && supported "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

setup() {
  if [[ -x .venv/bin/python ]] && ! supported .venv/bin/python; then
    echo "run.sh: .venv has an unsupported Python; recreating it." >&2
    rm -rf .venv
  fi
  if [[ ! -x .venv/bin/python ]]; then
    local python
    if ! python=$(find_python); then
      echo "run.sh: error: this project needs Python 3.9, 3.10 or 3.11" \
        "(tf.estimator ends with TensorFlow 2.15, which has no wheels for" \
        "newer Pythons). Found: $(python3 --version 2>&1 || echo none)." \
        "Install python3.11 or set PYTHON=/path/to/python3.11." >&2
      exit 1
    fi
    "$python" -m venv .venv
  fi
  # Reinstall only when the package metadata changed since the last install.
  local stamp=.venv/.installed-setup-cfg
  if [[ ! -f $stamp ]] || ! cmp -s setup.cfg "$stamp"; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[test,sweep]'
    cp setup.cfg "$stamp"
  fi
}

command=${1:-}
[[ $# -gt 0 ]] && shift
case "$command" in
  main)
    setup
    exec .venv/bin/python -m trainer.task --cpu-towers=2 "$@"
    ;;
  test)
    setup
    exec .venv/bin/python -m pytest "$@"
    ;;
  *)
    echo "usage: ./run.sh main [flags] | ./run.sh test [pytest args]" >&2
    exit 2
    ;;
esac
