"""The layer-sequential quantization pipeline: the method contract and registry (methods.py, contract.py),
the per-layer scheduler (layers.py), transform stages (transforms.py) and the resume folder (workdir.py)."""
