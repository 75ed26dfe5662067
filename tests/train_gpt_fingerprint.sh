# Sourced by the train_gpt example tests: `fingerprint LOG` prints "STEP HASH"
# from the line train_gpt ends with ("parameters after step N: fingerprint H").
fingerprint() { sed -n 's/^parameters after step \([0-9]*\): fingerprint \([0-9a-f]*\)$/\1 \2/p' "$1"; }
