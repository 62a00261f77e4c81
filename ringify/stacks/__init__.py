"""Models that other stacks parallelized or feed before ringify sees them: tensor
parallelism (torch's, transformers' and torchtitan's plans), FSDP2 units, FlexAttention
block masks and the samplers of a data loader."""
