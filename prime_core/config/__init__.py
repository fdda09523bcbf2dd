"""Config: loading and merging (``load``), CLI arguments (``cli_args``), the assembled schema
(``schema``), readable errors (``errors``) and checks against installed plugins (``checks``)."""
