"""HiPress's ground floor: the errors (``hipress_base.errors``) and the version
(``hipress_base.version``), which every layer imports without importing a layer above it
(``compll`` ◄ ``casync`` ◄ ``hipress`` ◄ the plugins). Users name them through the facade:
``hipress.SyncError``, ``hipress.__version__``."""
