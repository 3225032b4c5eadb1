#!/bin/sh
# ssh stand-in for the launcher tests: "fake_ssh.sh [ssh options] HOST COMMAND..." runs COMMAND
# on this machine inside a new UTS namespace whose host name is HOST, so each fake host has its
# own socket.gethostname() while all traffic stays on loopback. Used as Open MPI's
# plm_rsh_agent and as MPICH Hydra's -launcher-exec. Needs root (unshare).
while [ $# -gt 0 ]; do
  case "$1" in
    -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;  # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
if [ $# -lt 2 ]; then
  echo "fake_ssh.sh: usage: fake_ssh.sh [ssh options] HOST COMMAND..." >&2
  exit 255
fi
host=$1
shift
# the remote command arrives as words that a remote shell would join and re-parse
exec unshare --uts /bin/sh -c 'hostname "$1" && shift && exec /bin/sh -c "$*"' fake_ssh "$host" "$@"
