"""Engine integrations. ``kvtier.integrations.vllm`` needs vLLM; ``paged`` does not."""
