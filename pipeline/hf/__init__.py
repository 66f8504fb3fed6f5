"""Exports that Hugging Face tools load as they are: ``transformers`` remote code and tokenizer files.

``write_hf_files(export_dir)`` turns a ``model.io.save_pretrained`` folder into a ``transformers`` model folder.
The modules ``configuration_gca`` and ``modeling_gca`` are shipped inside that folder (``bundle``).
"""

from pipeline.hf.export import write_hf_files

__all__ = ["write_hf_files"]
