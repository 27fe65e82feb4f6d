"""The layer-sequential quantization pipeline: the per-layer scheduler (layers.py), transform stages
(transforms.py), the KV-cache observer (kvcache.py), the QAT training loop (qat_loop.py) and the resume
folder (workdir.py). The methods it runs, their contract and registry live in quantkit/algorithms/."""
