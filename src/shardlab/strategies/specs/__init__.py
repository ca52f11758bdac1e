"""The strategies' spec declarations, one module per implementation file of strategies/.

Every module here is imported by ``strategies.spec`` (by listing this package) and registers the
names it serves. Keep them free of torch imports: config validation and ``--help`` read them.
"""
