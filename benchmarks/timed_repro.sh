#!/bin/bash
# Timed fresh-clone reproduction (issue 16, item 8): clone, then run the given steps in order, each
# logged with its wall seconds to $LOG (read by `python -m benchmarks.repro_times $LOG`).
#   benchmarks/timed_repro.sh /path/to/fresh-clone setup language_train language repro
# setup: `make setup`; repro: `dvc repro` (every stage not yet up to date; each stage's start logged as a STAGE line); force:<stage>: `dvc repro -f -s <stage>`
# (that stage alone, rebuilt even when its outputs are up to date: a full rebuild, stage by stage);
# any other word: `dvc repro <stage>`.
set -u
dir=$1; shift
LOG=${LOG:-$dir/../repro_times.log}
cd "$dir" || exit 2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg PYTHONHASHSEED=0
for s in "$@"; do
  t0=$(date +%s); echo "$(date -u +%T) START $s" >> "$LOG"
  case $s in
    setup) make setup > "$LOG.$s.out" 2>&1;;
    repro) # each stage's start goes into the log as "HH:MM:SS STAGE <name>" (companion.budget times it from there)
      set -o pipefail
      bash -c '. .venv/bin/activate && dvc repro' 2>&1 | tee "$LOG.$s.out" | while IFS= read -r line; do
        case $line in "Running stage '"*) n=${line#Running stage \'}; echo "$(date -u +%T) STAGE ${n%%\'*}" >> "$LOG";; esac
      done;;
    force:*) bash -c ". .venv/bin/activate && dvc repro -f -s ${s#force:}" > "$LOG.${s#force:}.out" 2>&1;;
    *) bash -c ". .venv/bin/activate && dvc repro $s" > "$LOG.$s.out" 2>&1;;
  esac
  rc=$?; echo "$(date -u +%T) END $s rc=$rc seconds=$(( $(date +%s) - t0 ))" >> "$LOG"
  [ $rc -eq 0 ] || exit $rc
done
