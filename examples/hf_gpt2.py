"""A model from a well-kept zoo: Hugging Face's GPT-2, built from its config (small, random weights, nothing
downloaded), as a causal language model over byte ids trained with AdamW. Needs the zoo extra:

    pip install -e '.[zoo]'
    tapp profile --model examples/hf_gpt2.py:build --batch-size 8

torch.fx cannot trace transformers' models (their Python branches on the configuration and on which arguments
were given); TAPP then exports the model with ``torch.export`` on the workload's example inputs and splits the
exported graph, whose parameters keep the model's own names (``transformer.h.0.attn.c_attn.weight``...), so the
trained ``model.safetensors`` loads back into ``GPT2LMHeadModel``.
Dropout is off: an exported graph keeps the training mode it was exported in.
"""

from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQUENCE, WIDTH, LAYERS, HEADS = 256, 64, 64, 2, 4

workload = {
    "inputs": [{"shape": [SEQUENCE], "dtype": "int64", "high": VOCAB}],
    "targets": "next_token",
    "loss": "cross_entropy",
    "optimizer": {"name": "AdamW", "lr": 0.003, "weight_decay": 0.01, "betas": [0.9, 0.95]},
    "data": "synthetic",
    "output": "logits",  # of the CausalLMOutputWithCrossAttentions it returns: TAPP's loss reads one tensor
}


def build() -> nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQUENCE,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)
