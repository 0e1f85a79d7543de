#!/usr/bin/env bash
# Mutation testing of the safety-critical modules with mutmut (PyPI): one small wrong change
# at a time in the product code, then the tests of that module's area; a mutant the tests
# do not notice is a blind spot. Prints per module: mutants, killed, timeout, survived,
# equivalent (listed in bench/mutation-survivors.md with the reason) and the kill rate, and
# writes the survivors not listed there to bench/results/mutation-run.txt.
#
#   bench/mutation.sh [--quick] [--budget MIN] [--jobs N] [--only MODULE]... [--keep]
#   bench/mutation.sh --hand [--only ID]... [--list]
#
#   --quick       every 4th mutant of each module, 6 minutes at most: a smoke run
#   --budget MIN  stop after MIN minutes of wall time (default 60; every module took 43 min on 2 cores); modules not reached
#                 and mutants not tried are reported as 'not checked'
#   --jobs N      mutmut worker processes (default 2: the CI machine has 2 cores)
#   --only M      just this module (as written in MODULES; repeatable)
#   --keep        keep the scratch trees (mutmut results browse there: mutmut browse)
#   --hand        instead: the hand-written mutants of bench/hand_mutants.py, the shapes mutmut's
#                 operators cannot make (a guard deleted, the audit record moved after the action,
#                 os.kill turned into os.killpg); the rest of the arguments go to it
#
# mutmut wants the code under ./, src/ or source/ and the tests beside it; gpuguard keeps it
# in daemon/gpuguard, so each module gets a scratch tree in $TMPDIR: src/gpuguard (a copy),
# tests/, the repo files tests read, and pyproject.toml with a [tool.mutmut] section naming
# the one module and its area's tests. Only in-process calls count: mutmut selects, per
# function, the tests that called it, and a test's subprocesses (the daemon, simulated
# engines, the CLI) run the unmutated copy.
set -euo pipefail

# What is mutated and by which tests. One line per module:
#   module (under daemon/gpuguard) | functions (globs on `Class.method` / `function`) | tests
# Tests are pytest arguments without spaces (paths, node ids, --ignore=...). Keep it in step
# when modules move: the survivors file keys mutants by module + function + line text, so
# after a move only its module column changes. The PCIe walk (hw/pcie.py) stays last.
MODULES='
profiles/plan.py   | *  | tests/profiles/test_plan.py tests/profiles/test_plan_exact.py tests/profiles/test_apply_exact.py tests/hw/test_od_levels.py
profiles/apply.py  | *  | tests/profiles --ignore=tests/profiles/test_daemon_sim.py --ignore=tests/profiles/test_cli_effective.py tests/state/test_state_machine.py tests/power/test_psu_replay.py tests/nvml/test_nvml_profiles.py
state/identity.py  | *  | tests/state
state/gpus.py      | *  | tests/state tests/kernel/test_router.py tests/nvml/test_nvml_events.py
engines/stall.py   | *  | tests/engines/test_stall.py tests/engines/test_stall_exact.py tests/engines/test_reference_metrics.py
engines/actions.py | *  | tests/engines/test_actions_exact.py tests/engines/test_kill_on_stall.py tests/engines/test_kill_safety.py
engines/process.py | *  | tests/engines/test_process_exact.py tests/engines/test_config_and_process.py tests/engines/test_exact_kill_and_restart.py tests/engines/test_kill_safety.py
kernel/rules.py    | *  | tests/kernel --ignore=tests/kernel/test_cli_events.py --ignore=tests/kernel/test_alert_flood.py
kernel/router.py   | *  | tests/kernel --ignore=tests/kernel/test_cli_events.py --ignore=tests/kernel/test_alert_flood.py tests/state/test_gpus.py
control/auth.py    | *  | tests/service/test_auth_exact.py tests/service/test_auth.py tests/service/test_api.py
state/audit.py     | *  | tests/service/test_audit_exact.py tests/service/test_service_config_and_audit.py tests/service/test_api.py
hw/pcie_p2p.py     | *  | tests/pcie --ignore=tests/pcie/test_cli.py
hw/pcie_verdict.py | *  | tests/pcie --ignore=tests/pcie/test_cli.py
hw/pcie_model.py   | PcieLink.* GpuPath.* GpuPair.* format_speed format_gbps | tests/pcie --ignore=tests/pcie/test_cli.py --ignore=tests/pcie/test_conditions.py
hw/pcie.py         | parse_link_speed parse_aer _role _link _root_bus_link _gpu_path _pair parse_resource parse_dpm_pcie kernel_vram is_gpu | tests/pcie --ignore=tests/pcie/test_cli.py --ignore=tests/pcie/test_conditions.py
'

REPO=$(cd "$(dirname "$0")/.." && pwd)
BUDGET_MIN=60 SAMPLE=1 JOBS=2 KEEP=0 ONLY=()
[ "${1:-}" = --hand ] && { shift; exec python3 "$(dirname "$0")/hand_mutants.py" "$@"; }
while (($#)); do
  case $1 in
    --quick) SAMPLE=4 BUDGET_MIN=6 ;;
    --budget) BUDGET_MIN=$2; shift ;;
    --jobs) JOBS=$2; shift ;;
    --only) ONLY+=("$2"); shift ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

python3 -c 'import mutmut' 2>/dev/null || { echo "mutmut is not installed: pip install mutmut" >&2; exit 2; }
MUTMUT=(python3 -m mutmut)
command -v mutmut >/dev/null && MUTMUT=(mutmut)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpuguard-mutation.XXXXXX")
TOKEN=$(basename "$WORK")
export GPUGUARD_MUTATION_RUN=$TOKEN  # every process a run starts carries it: found and ended after each module
[ -d "$REPO/../shared/reference" ] && export GPUGUARD_REFERENCE=${GPUGUARD_REFERENCE:-$(cd "$REPO/../shared/reference" && pwd)}
unset PYTHONPATH
RESULTS=$WORK/results.jsonl WALLS=$WORK/walls
: >"$RESULTS"; : >"$WALLS"

leftovers() {  # processes our tests left behind (a mutant may stop a kill from working)
  local p
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" = $$ ] && continue
    if { tr "\0" "\n" <"/proc/$p/environ"; } 2>/dev/null | grep -qx "GPUGUARD_MUTATION_RUN=$TOKEN"; then
      kill -9 "$p" 2>/dev/null || true
    fi
  done
}
unmount() {  # FUSE mounts of a test whose worker was stopped mid-test
  local m
  { findmnt -rn -o TARGET | grep "^$WORK/" || true; } | sort -r | while read -r m; do
    fusermount3 -u -z "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
}
cleanup() { leftovers; unmount; if ((KEEP)); then echo "scratch trees kept in $WORK"; else rm -rf "$WORK"; fi; }
trap cleanup EXIT

toml_list() { local out="" x; for x in "$@"; do out+="\"$x\", "; done; echo "[${out%, }]"; }

START=$(date +%s)
DEADLINE=$((START + BUDGET_MIN * 60))
echo "mutation run: budget ${BUDGET_MIN} min, ${JOBS} workers, sample 1/${SAMPLE}, scratch $WORK"
while IFS='|' read -r module functions tests; do
  module=$(echo "$module" | xargs); functions=$(echo "$functions" | xargs); tests=$(echo "$tests" | xargs)
  [ -z "$module" ] && continue
  if ((${#ONLY[@]})) && [[ ! " ${ONLY[*]} " == *" $module "* ]]; then continue; fi
  s=$WORK/$(echo "$module" | tr '/.' '__')
  mkdir -p "$s/src" "$s/mutants"
  cp -rL "$REPO/daemon/gpuguard" "$s/src/gpuguard"
  find "$s/src" -name __pycache__ -prune -exec rm -rf {} +
  cp -rL "$REPO/tests" "$s/tests"
  for d in config units grafana deploy docs README.md; do [ -e "$REPO/$d" ] && cp -rL "$REPO/$d" "$s/$d"; done
  # Tests that start `python -m gpuguard…` with PYTHONPATH=<repo>/daemon get the unmutated copy.
  ln -s ../src "$s/mutants/daemon"
  mkdir -p "$s/plugins" && cp "$REPO/bench/mutation_order.py" "$s/plugins/"
  read -ra targs <<<"$tests"
  {
    cat "$REPO/pyproject.toml"
    echo
    echo "[tool.mutmut]"
    echo 'source_paths = ["src"]'
    echo "only_mutate = [\"src/gpuguard/$module\"]"
    echo "pytest_add_cli_args_test_selection = $(toml_list "${targs[@]}")"
    # (no:unraisableexception: its gc.collect()s after every run were a third of a mutant's time)
    echo 'pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "no:unraisableexception", "-p", "mutation_order", "-W", "ignore::DeprecationWarning"]'
    echo 'also_copy = ["config", "units", "grafana", "deploy", "docs", "README.md"]'
  } >"$s/pyproject.toml"
  (cd "$s" && python3 "$REPO/bench/mutation_report.py" names --module "$module" --functions "$functions" \
     --sample "$SAMPLE") >"$s/names"
  left=$((DEADLINE - $(date +%s)))
  t0=$(date +%s)
  echo
  echo "== $module: $(wc -l <"$s/names") mutants, tests: $tests"
  if ((left > 30)); then
    mapfile -t names <"$s/names"
    # 1: mutmut makes the mutants and records which test calls which function (running
    # one mutant on the way); the record is widened to whole test files (widen's note);
    # 2: every mutant, against the widened record. mutmut's console is a progress line:
    # its full output stays in the scratch tree's mutmut.log.
    if ! (cd "$s" && export PYTHONPATH="$s/src:$s/plugins" && deadline() { echo $((DEADLINE - $(date +%s))); } \
          && timeout --signal=INT --kill-after=60 "$(deadline)" nice -n 19 "${MUTMUT[@]}" run \
               --max-children "$JOBS" "${names[0]}" >mutmut.log 2>&1 \
          && python3 "$REPO/bench/mutation_report.py" widen >>mutmut.log \
          && timeout --signal=INT --kill-after=60 "$(deadline)" nice -n 19 "${MUTMUT[@]}" run \
               --max-children "$JOBS" "${names[@]}" >>mutmut.log 2>&1); then
      echo "   mutmut stopped early (budget or failure); its log ends:"
      tr '\r' '\n' <"$s/mutmut.log" | grep -v '^\s*$' | tail -n 5 | sed 's/^/   | /'
    fi
  else
    echo "   budget spent: not run"
  fi
  leftovers; unmount
  echo "$module $(($(date +%s) - t0))" >>"$WALLS"
  (cd "$s" && python3 "$REPO/bench/mutation_report.py" collect --module "$module" --names names --out "$RESULTS")
done <<<"$MODULES"

echo
echo "== done in $(($(date +%s) - START)) s on $(nproc) cores ($(uname -n))"
mkdir -p "$REPO/bench/results"
python3 "$REPO/bench/mutation_report.py" summary --results "$RESULTS" --wall-file "$WALLS" \
  --equivalents "$REPO/bench/mutation-survivors.md" --out "$REPO/bench/results/mutation-run.txt"
