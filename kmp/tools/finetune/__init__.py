"""`kmp finetune`: a KerasHub causal LM fine-tuned from a local preset by a
config file (`kmp_cli.finetune_config`), with LoRA or QLoRA under mixed
precision."""
