#!/usr/bin/env bash
# Every C++ file of the project follows .clang-format: lists the files that
# do not and fails. Usage: check_format.sh CLANG_FORMAT SOURCE_DIR
set -euo pipefail
fmt=$1 src=$2
cd "$src"
mapfile -t files < <(git ls-files 'src/*.cpp' 'src/*.h' 'include/*.h' 'tests/*.cpp' 'tests/*.h' 'examples/*.cpp' \
  'examples/*.h' 'bench/*.cpp' 'tools/*.cpp' 'tools/*.h' 2>/dev/null || true)
if [ ${#files[@]} -eq 0 ]; then
  # Not a git checkout (an unpacked tarball): every file on disk.
  mapfile -t files < <(find src include tests examples bench tools -name '*.cpp' -o -name '*.h')
fi
[ ${#files[@]} -gt 0 ] || { echo "check_format: no C++ files under $src" >&2; exit 1; }
# One run over every file (a process per file took four times as long);
# only when it fails, one per file to name them.
"$fmt" --dry-run -Werror "${files[@]}" > /dev/null 2>&1 && {
  echo "check_format: ${#files[@]} files follow .clang-format"
  exit 0
}
bad=()
for f in "${files[@]}"; do
  "$fmt" --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "check_format: ${#bad[@]} of ${#files[@]} files differ from .clang-format (run: $fmt -i FILE):"
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "check_format: ${#files[@]} files follow .clang-format"
