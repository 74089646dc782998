"""The serving benchmark of the paper's Sec. 8.3: every system behind the same OpenAI HTTP API.

``workload`` samples requests (ShareGPT, tokenized with the model's tokenizer, or fixed
lengths) and Poisson arrival times; ``client`` sends them and times TTFT/TPOT/E2E per request;
``report`` turns the records into percentiles, SLO attainment, goodput and the SLO-scale sweep;
``runner`` starts each server in turn and drives the sweep (``python -m sandwich_tvm.bench serve``).
"""
