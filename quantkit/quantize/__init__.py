"""What the conversion does inside the layers: the layer walk with its chunk scheduler and observer protocol
(walk.py), the conversion's visit of each layer (layers.py), transform stages (transforms.py), the KV-cache
observer (kvcache.py), the fine-tune loop (finetune.py) and the resume folder (workdir.py). The methods it
runs, their contract and registry live in quantkit/algorithms/; the core that strings it together is
quantkit/pipeline.py. See docs/design.md."""
