"""Mixture-of-experts layers: router top-k selection (topk.py), the expert computation (fused_moe.py) and the
block a sparse decoder layer uses as its MLP (moe_block.py)."""
