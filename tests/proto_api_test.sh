#!/usr/bin/env bash
# The API's compatibility, held with buf (proto/buf.yaml says which checks): the .proto files
# lint clean, nothing in them breaks the wire or the JSON mapping against v1's baseline
# (proto/api_baseline.binpb), and the check is not vacuous: a copy with a field taken out and
# one with a field renumbered are refused (by buf's rule ids, which stay where its wording may
# not). Skips (77) where buf is not installed: scripts/install_deps.sh puts it in .tools/ with
# npm, unless one is on PATH already, which is used then.
#
#   tests/proto_api_test.sh [REPOSITORY_ROOT]
set -u
root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
buf="$root/.tools/node_modules/.bin/buf"
[[ -x "$buf" ]] || buf=$(command -v buf)
if [[ -z "$buf" || ! -x "$buf" ]]; then
  echo "SKIP: buf is not installed (scripts/install_deps.sh installs it)"
  exit 77
fi
failed=0
cd "$root/proto" || exit 2
"$buf" lint || { echo "FAIL: buf lint"; failed=1; }
"$buf" breaking --against api_baseline.binpb ||
  { echo "FAIL: a breaking change against api_baseline.binpb"; failed=1; }

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
proto=kvrecall/v1/kvrecall.proto
# Each mutation of a copy of proto/, the rule buf must refuse it by and a word its finding names.
check_refused() {
  local name="$1" edit="$2" rule="$3" word="$4"
  rm -rf "${scratch:?}/$name" && mkdir -p "$scratch/$name" && cp -r . "$scratch/$name/"
  sed -i -E "$edit" "$scratch/$name/$proto"
  if cmp -s "$proto" "$scratch/$name/$proto"; then
    echo "FAIL: the mutation '$name' changed nothing (was the field renamed?)"
    failed=1
    return
  fi
  local out
  out=$(cd "$scratch/$name" &&
        "$buf" breaking --against "$root/proto/api_baseline.binpb" --error-format=json 2>&1)
  if [[ $? -eq 0 || "$out" != *"\"type\":\"$rule\""* || "$out" != *"$word"* ]]; then
    echo "FAIL: '$name' was not refused by $rule naming $word: $out"
    failed=1
  fi
}
check_refused deleted-field '/^  string request_id = 5;/d' \
  FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED request_id
check_refused renumbered-field 's/^(  uint64 max_reply_bytes = )7;/\189;/' \
  FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED max_reply_bytes

[[ $failed -eq 0 ]] && echo "PASS: proto lint, no breaking change, mutations refused"
exit $failed
