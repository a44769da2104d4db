"""Run llama.cpp's ``convert_hf_to_gguf.py`` in this process, naming an unknown pre-tokenizer by its structure.

A script, run by :func:`llmtune.export.llamacpp.convert` in a subprocess (never imported by llmtune)::

    python llamacpp_convert.py --llama-cpp DIR --pre-fallback NAME -- MODEL_DIR --outfile F --outtype f16

The converter is llama.cpp's, unchanged, with its own ``gguf-py`` first on ``sys.path`` (as the converter itself
arranges). One method is wrapped: ``TextModel.get_vocab_base_pre`` names the BPE pre-tokenizer from a hash of the
probe text's token ids; when the hash is unknown it raises ``NotImplementedError``, and the wrapper answers with
``--pre-fallback`` (the pre-tokenizer whose rules equal tokenizer.json's, found by the parent) or exits 3. Prints
one line ``LLMTUNE_PRE {json}`` saying which pre-tokenizer was written and how it was found.
"""

from __future__ import annotations

import argparse
import json
import sys
from hashlib import sha256
from pathlib import Path


def main(argv: list[str]) -> int:
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp", required=True)
    parser.add_argument("--pre-fallback", default="")
    ours = parser.parse_args(argv[:split])
    where = Path(ours.llama_cpp)
    sys.path.insert(0, str(where))
    sys.path.insert(1, str(where / "gguf-py"))
    import convert_hf_to_gguf as converter
    from conversion.base import TextModel

    original = TextModel.get_vocab_base_pre
    found: dict = {"pre_tokenizer": None, "pre_tokenizer_source": None}

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            name = original(self, tokenizer)
            found.update(pre_tokenizer=name, pre_tokenizer_source="hash")
            return name
        except NotImplementedError:
            # the converter's own probe text, from its source (the method's first string constant holding it)
            probe = next(c for c in original.__code__.co_consts if isinstance(c, str) and "🚀" in c)
            found["pre_tokenizer_hash"] = sha256(str(tokenizer.encode(probe)).encode()).hexdigest()
            if not ours.pre_fallback:
                print("LLMTUNE_PRE " + json.dumps(found), flush=True)
                sys.exit(3)
            found.update(pre_tokenizer=ours.pre_fallback, pre_tokenizer_source="structure")
            return ours.pre_fallback

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", *argv[split + 1:]]
    converter.main()
    print("LLMTUNE_PRE " + json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
