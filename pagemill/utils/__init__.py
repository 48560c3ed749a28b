"""Small helpers with vLLM's import paths (pagemill.utils.argparse_utils, ...)."""
