"""Thin argparse front-ends; `python -m sandwich_tvm.<verb>` runs each."""
