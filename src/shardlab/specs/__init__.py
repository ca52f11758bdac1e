"""Every fact about a strategy name, torch-free and low in the layers: config, layout and the training pieces read it.

    registry.py        StrategySpec and the registry (spec, lookup, names, find, ...)
    ddp.py, ...        the declarations, one module per implementation file of strategies/: each registers the names
                       it serves; registry.py imports them all by listing this package

Keep every module here free of torch imports: config validation and ``--help`` read them. The engines themselves
(strategies/) sit above the training pieces, which read these facts; a spec names its implementation as a string.
The package itself imports nothing.
"""
