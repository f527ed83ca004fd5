"""Ahead of time: ``export`` (torch.export with regions spliced as one custom op), the package
on disk (``package``: save, verify, ``load``) and the lean generation loop a loaded LLM package
runs (``runner``). Loading runs no rule, partition, region compile or Dynamo trace."""
