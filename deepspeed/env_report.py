from deepspeed_ext.env_report import cli_main, main

__all__ = ["cli_main", "main"]
