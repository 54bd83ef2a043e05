#!/usr/bin/env bash
# Ascend node preflight: the checks ROLL's Ascend guide runs by hand before a multi-node job
# (alibaba/ROLL docs_roll/docs/User Guides/Hardware Support/ascend_npu_examples.md, "Verify NPU
# Network Connectivity"), one line per check, exit 1 naming what failed. Run it on EVERY node,
# inside the container the job runs in (docs/gpu-npu.md, "Containers"):
#   bash launch/npu_preflight.sh                          # this node
#   bash launch/npu_preflight.sh --peer 192.168.1.8       # + ping that device IP from every device
#   bash launch/npu_preflight.sh --dry-run                # the commands, run nothing
# Checks:
#   health   npu-smi info: every NPU's Health is OK
#   link     hccn_tool -i N -link -g: every device's RoCE link is UP
#   tls      hccn_tool -i N -tls -g: the TLS switch is the same on every device (HCCL links
#            between devices whose TLS differs fail; ROLL's fix is printed when it differs: run
#            it on every device of EVERY node)
#   ip       hccn_tool -i N -ip -g: every device has an IP (HCCL's cross-node transport)
#   ping     (--peer only) hccn_tool -i N -ping -g address PEER: 0% loss from every device to the
#            other node's device IP(s): one IP for all, or one per device (comma-separated)
#   cann     the CANN toolkit's version = the one requirements-npu.txt names (vllm-ascend 0.23.0
#            needs CANN 9.1.0)
#   driver   the driver's version (ASCEND_HOME/driver/version.info); requirements-npu.txt names no
#            minimum (vllm-ascend: "refer to the CANN 9.1.0 release notes"), so it is printed
# Options: --devices N (default: npu-smi's count; 8 in a dry run; an A3 node: 16), --peer IPS,
# --dry-run, --help. ASCEND_HOME (default /usr/local/Ascend) locates the version files.
# Not run on Ascend hardware by this project (no NPU was available): the output formats parsed
# below are those of ROLL's guide and CANN's tool documentation; tests/test_preflight.py runs it
# against stand-in tools.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ASCEND_HOME=${ASCEND_HOME:-/usr/local/Ascend}

usage() { sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

dry=0; peer=""; n=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --peer) peer=${2:?--peer needs an IP (or IPs, comma-separated)}; shift ;;
    --peer=*) peer=${1#--peer=} ;;
    --devices) n=${2:?--devices needs a number}; shift ;;
    --devices=*) n=${1#--devices=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "npu_preflight: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done

want_cann=$(grep -o 'CANN [0-9][0-9.]*' "$root/requirements-npu.txt" | head -1 | cut -d' ' -f2)

if [ "$dry" = 1 ]; then
  n=${n:-8}
  echo "npu-smi info"
  for ((i = 0; i < n; i++)); do
    echo "hccn_tool -i $i -link -g"; echo "hccn_tool -i $i -tls -g"; echo "hccn_tool -i $i -ip -g"
  done
  if [ -n "$peer" ]; then
    IFS=, read -r -a peers <<< "$peer"
    for ((i = 0; i < n; i++)); do
      echo "hccn_tool -i $i -ping -g address ${peers[$((${#peers[@]} > 1 ? i : 0))]}"
    done
  fi
  echo "cat $ASCEND_HOME/ascend-toolkit/latest/*/ascend_toolkit_install.info   # expect version=$want_cann"
  echo "cat $ASCEND_HOME/driver/version.info"
  exit 0
fi

for tool in hccn_tool npu-smi; do
  if ! command -v "$tool" > /dev/null; then
    echo "npu_preflight: no $tool on this machine (not an Ascend node, or the driver's tools are" \
      "not on PATH / not mounted into the container): nothing checked" >&2
    exit 1
  fi
done

failed=()
say() {  # say ok|FAIL check detail
  printf '%-4s %-6s %s\n' "$1" "$2" "$3"
  if [ "$1" = FAIL ]; then failed+=("$2"); fi
}

smi=$(npu-smi info 2>&1)
if [ -z "$n" ]; then
  n=$(npu-smi info -l 2>/dev/null | awk -F: '/Total Count/ {gsub(/ /, "", $2); print $2}')
  n=${n:-8}
fi
# the first row of each NPU in npu-smi's table: "| 0     910B3 | OK | ..."
health=$(printf '%s\n' "$smi" | awk -F'|' '$2 ~ /^ *[0-9]+ +[^ ]/ {split($2, a, " "); gsub(/ /, "", $3); print a[1] ":" $3}')
bad=$(printf '%s\n' "$health" | grep -v ':OK$' | tr '\n' ' ')
if [ -z "$health" ]; then
  say FAIL health "npu-smi info lists no NPU"
elif [ -n "$bad" ]; then
  say FAIL health "not OK: $bad(npu-smi info)"
else
  say ok health "$(printf '%s\n' "$health" | wc -l | tr -d ' ') NPU(s) OK"
fi

down=""; tls=""; noip=""; ips=""
for ((i = 0; i < n; i++)); do
  hccn_tool -i "$i" -link -g 2>&1 | grep -qi 'link status: *up' || down+="$i "
  tls+="$i:$(hccn_tool -i "$i" -tls -g 2>&1 | grep -i switch | grep -o '[0-9]\+' | tail -1) "
  ip=$(hccn_tool -i "$i" -ip -g 2>&1 | grep -io 'ipaddr *: *[0-9.]*' | grep -o '[0-9.]*$')
  if [ -z "$ip" ]; then noip+="$i "; else ips+="$i:$ip "; fi
done
if [ -n "$down" ]; then say FAIL link "down on device(s) $down(hccn_tool -i N -link -g)"; else say ok link "$n device(s) UP"; fi
if [ "$(printf '%s\n' $tls | cut -d: -f2 | sort -u | wc -l)" -gt 1 ]; then
  say FAIL tls "the TLS switch differs (${tls}); disable it on every device of every node: for i in \$(seq 0 $((n - 1))); do hccn_tool -i \$i -tls -s enable 0; done"
else
  say ok tls "the same on every device ($tls)"
fi
if [ -n "$noip" ]; then say FAIL ip "no IP on device(s) $noip(hccn_tool -i N -ip -g)"; else say ok ip "$ips"; fi

if [ -n "$peer" ]; then
  IFS=, read -r -a peers <<< "$peer"
  lost=""
  for ((i = 0; i < n; i++)); do
    to=${peers[$((${#peers[@]} > 1 ? i : 0))]}
    hccn_tool -i "$i" -ping -g address "$to" 2>&1 | grep -q '[^0-9.]0\(\.0*\)\{0,1\}% packet loss' || lost+="$i->$to "
  done
  if [ -n "$lost" ]; then say FAIL ping "loss or no answer: $lost"; else say ok ping "every device reaches $peer"; fi
fi

cann=$(grep -h '^version=' "$ASCEND_HOME"/ascend-toolkit/latest/*/ascend_toolkit_install.info 2>/dev/null | head -1 | cut -d= -f2)
if [ "$cann" = "$want_cann" ]; then
  say ok cann "$cann"
else
  say FAIL cann "found '${cann:-none}' in $ASCEND_HOME/ascend-toolkit/latest, requirements-npu.txt needs $want_cann"
fi
driver=$(grep -i '^version=' "$ASCEND_HOME/driver/version.info" 2>/dev/null | head -1 | cut -d= -f2)
if [ -n "$driver" ]; then
  say ok driver "$driver (no minimum pinned: the CANN $want_cann release notes name it)"
else
  say FAIL driver "no $ASCEND_HOME/driver/version.info (driver not installed or not mounted)"
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "npu_preflight: failed: ${failed[*]}" >&2
  exit 1
fi
