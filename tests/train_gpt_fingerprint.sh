# Sourced by the train_gpt example tests with their arguments
# (TORCHRUN TRAIN_GPT [train_gpt options for every run]): sets torchrun, train
# and extra (the options), makes a temporary directory $tmp removed on exit,
# and defines `fingerprint LOG`, which prints "STEP HASH" from the line
# train_gpt ends with ("parameters after step N: fingerprint H").
torchrun=$1 train=$2
extra=("${@:3}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fingerprint() { sed -n 's/^parameters after step \([0-9]*\): fingerprint \([0-9a-f]*\)$/\1 \2/p' "$1"; }
