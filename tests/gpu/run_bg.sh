#!/bin/bash
# A command longer than one 10-minute call of a lent GPU machine (docs/gpu.md): started in a session of its own, it
# outlives the call and the next calls wait for it while the machine stays warm.
# tests/gpu/run_bg.sh start NAME CMD...   run CMD (a shell string) in a session of its own (it outlives the call); its files in /tmp/bg/NAME.out
#                           (exported as D), its output in /tmp/bg/NAME.log, its status in /tmp/bg/NAME.rc
# tests/gpu/run_bg.sh wait NAME SECONDS OUT   wait up to SECONDS for NAME; tar its files + log into OUT/NAME.tgz; print the log's tail
mkdir -p /tmp/bg
case "$1" in
start)
  name=$2; shift 2; mkdir -p /tmp/bg/$name.out; rm -f /tmp/bg/$name.rc
  D=/tmp/bg/$name.out setsid bash -c "$* ; echo \$? > /tmp/bg/$name.rc" > /tmp/bg/$name.log 2>&1 < /dev/null &
  echo "started $name" ;;
wait)
  name=$2; secs=$3; out=$4; t=$SECONDS
  while [ ! -f /tmp/bg/$name.rc ] && [ $((SECONDS - t)) -lt $secs ]; do sleep 3; done
  if [ -f /tmp/bg/$name.rc ]; then echo "=== $name ended rc=$(cat /tmp/bg/$name.rc)"; else echo "=== $name still running after ${secs}s"; fi
  cp /tmp/bg/$name.log /tmp/bg/$name.out/ 2>/dev/null
  tar czf "$out/$name.tgz" -C /tmp/bg $name.out 2>/dev/null
  grep -v -E "^(INFO|DEBUG) |^\[rank|it/s\]" /tmp/bg/$name.log | cut -c1-300 | tail -n ${TAILN:-60} ;;
esac
