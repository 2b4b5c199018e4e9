"""Per-tensor sha256 of a safetensors file: `write FILE OUT.json` here, `check FILE REF.json` on the device machine.

The device machine rebuilds SmolLM2 from its GGUF (the fp32 checkpoint is 538 MB, over what one call carries);
`check` exits non-zero unless every tensor is bit-identical to the checkpoint the reference was written from.
"""

import hashlib
import json
import sys

from safetensors.numpy import load_file


def tensor_digests(path: str) -> dict[str, str]:
    return {name: hashlib.sha256(array.tobytes()).hexdigest() for name, array in load_file(path).items()}


def main(mode: str, path: str, reference: str) -> int:
    digests = tensor_digests(path)
    if mode == "write":
        with open(reference, "w") as f:
            json.dump(digests, f)
        return 0
    with open(reference) as f:
        expected = json.load(f)
    equal = sum(digests.get(name) == digest for name, digest in expected.items())
    print(f"weights: {equal} of {len(expected)} tensors bit-identical ({len(digests)} in {path})")
    return 0 if equal == len(expected) == len(digests) else 1


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("write", "check"):
        sys.exit("usage: weights_digest.py write|check MODEL.safetensors DIGESTS.json")
    sys.exit(main(*sys.argv[1:]))
