#!/usr/bin/env bash
# bfexp's GPU checks, one command for a one-GPU machine (fits 10 minutes; README "GPU engine"):
#   scripts/gpu_checks.sh [WHEELS_DIR] [--out DIR] [--budget SECONDS]
# WHEELS_DIR: wheels of what bfexp needs beyond the machine's torch, CuPy and NCCL, installed with no
# network. Results: DIR/summary.json (default ./gpu-checks). Steps and options: scripts/gpu_checks.py.
# PYTHON names the interpreter that has torch and CuPy (default python3).
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_checks.py" "$@"
