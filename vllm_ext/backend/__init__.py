"""vLLM glue: the SPEEDSFI backend class, its metadata builder and its impl."""
