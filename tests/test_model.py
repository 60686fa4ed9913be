import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_lowbit_kv.model import prepare_model


def test_embedded_model_continues_with_paris():
    folder = prepare_model(progress=False)  # cached by the set-up; no network
    assert (folder / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (30, 3, 64)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" Paris")
