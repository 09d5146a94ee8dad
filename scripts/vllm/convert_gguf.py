"""The SmolLM2 GGUF the engine serves, as a Hugging Face checkpoint vLLM serves.

vLLM wants safetensors; transformers reads the GGUF (dequantizing its Q4_1 blocks), and the
dense weights, copied into a plain model of the same config, are saved with the tokenizer
(chat template included) and a config.json without `quantization_config`. Both backends then
run the same weights: what `loadtest/bench/vs_vllm_cpu.py` compares.

Usage: python convert_gguf.py MODEL.gguf OUT_DIR
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def main(gguf: str, out: str) -> None:
    src_dir, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    packed = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    cfg = packed.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    # A model loaded from GGUF refuses save_pretrained: copy its weights into a plain one.
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(packed.state_dict(), strict=False)
    model.tie_weights()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        diff = (packed(**ids).logits.float() - model(**ids).logits.float()).abs().max().item()
    if diff != 0.0 or [k for k in missing if "lm_head" not in k] or unexpected:
        sys.exit(f"convert_gguf: the copy differs (max logit diff {diff}, missing {missing}, unexpected {unexpected})")
    tmp = out + ".part"
    os.makedirs(tmp, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    path = os.path.join(tmp, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    if not tok.chat_template:
        sys.exit("convert_gguf: the tokenizer has no chat template")
    os.replace(tmp, out)
    print(f"convert_gguf: {out} ({', '.join(sorted(os.listdir(out)))})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
