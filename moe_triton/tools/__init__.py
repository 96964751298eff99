"""The tools room: the command line, the demo, the probe and the bench helpers.

They sit on top of the library and may import any of it; nothing in the library (the stages,
the layer, runners/, parallel/, models/, graphs/) imports them (tests/test_layout.py checks).

    cli.py    `moe-triton demo | bench | resolve | probe`; environment variables are read here only
    demo.py   the main job: a tiny MoE checkpoint built once, loaded, generated, checked against transformers
    probe.py  the temperature-0 probe: one layer on two backends, compared
    bench.py  layer shapes, random experts and inputs, ceilings, the roofline floor, timing
"""
