"""Child process of test_loading.py: transformers' from_pretrained / save_pretrained call
forms on CPU, printed as JSON, with torchjax imported (argv[1] == "torchjax") or not.

Run as ``python -m tests.integrations._hf_call_forms {torchjax,plain} DIR``.
"""

import inspect
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
import transformers as tf  # noqa: E402

if sys.argv[1] == "torchjax":
    import torchjax  # noqa: F401
from transformers import modeling_utils  # noqa: E402

IDS = torch.tensor([[1, 17, 42, 99, 5, 6]])
CLASSES = ("AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification")


def _config():
    return tf.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, num_labels=3,
    )  # fmt: skip


def _fingerprint(model) -> dict:
    with torch.no_grad():
        out = model(IDS)
    first = out[0] if isinstance(out, tuple) else next(iter(out.values()))
    return {
        "class": type(model).__name__,
        "device": str(next(model.parameters()).device),
        "weights": sorted((k, float(v.double().sum())) for k, v in model.state_dict().items()),
        "output": first.flatten().tolist(),
    }


def _signatures() -> dict:
    functions = {
        "from_pretrained": modeling_utils.PreTrainedModel.from_pretrained,
        "save_pretrained": modeling_utils.PreTrainedModel.save_pretrained,
        "_load_pretrained_model": modeling_utils.PreTrainedModel._load_pretrained_model,
        "safe_save_file": modeling_utils.safe_save_file,
        "LlamaForCausalLM.from_pretrained": tf.LlamaForCausalLM.from_pretrained,
        "AutoModel.from_pretrained": tf.AutoModel.from_pretrained,
        "AutoConfig.from_pretrained": tf.AutoConfig.from_pretrained,
    }
    return {
        name: [str(inspect.signature(f)), f.__name__, f.__doc__] for name, f in functions.items()
    }


def main(root: str) -> dict:
    result = {"signatures": _signatures()}
    for i, name in enumerate(CLASSES):
        auto = getattr(tf, name)
        torch.manual_seed(i)
        model = auto.from_config(_config()).eval()
        positional, keyword = (os.path.join(root, f"{name}-{form}") for form in ("pos", "kw"))
        model.save_pretrained(positional)
        model.save_pretrained(save_directory=keyword, safe_serialization=True)
        result[f"{name}.saved"] = [sorted(os.listdir(d)) for d in (positional, keyword)]
        result[name] = [
            _fingerprint(auto.from_pretrained(positional)),
            _fingerprint(auto.from_pretrained(pretrained_model_name_or_path=keyword)),
            _fingerprint(auto.from_pretrained(positional, dtype=torch.float32, device_map="cpu")),
        ]
        config = tf.AutoConfig.from_pretrained(pretrained_model_name_or_path=keyword)
        result[f"{name}.config"] = [
            tf.AutoConfig.from_pretrained(positional).to_dict(),
            config.to_dict(),
        ]
        if name == "AutoModelForCausalLM":
            cls = tf.LlamaForCausalLM
            result["LlamaForCausalLM"] = [
                _fingerprint(cls.from_pretrained(positional)),
                _fingerprint(cls.from_pretrained(pretrained_model_name_or_path=keyword)),
                _fingerprint(cls.from_pretrained(keyword, config=config)),
            ]
    # transformers' own error for a missing path, unchanged.
    try:
        tf.LlamaForCausalLM.from_pretrained()
    except TypeError as e:
        result["missing_path_error"] = str(e)
    return result


if __name__ == "__main__":
    # Paths differ between the two runs (config["_name_or_path"]): named relative to DIR.
    print(json.dumps(main(sys.argv[2]), default=str).replace(sys.argv[2], "DIR"))
