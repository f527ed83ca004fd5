"""Ahead of time: ``export`` (torch.export with regions spliced as one custom op), the package
on disk (``package``: verify, ``load``; ``write``: save, atomically; ``confine``: nothing a
manifest names leads outside the package) and the lean generation loop a loaded LLM package
runs (``runner``). Loading runs no rule, partition, region compile or Dynamo trace, and imports
none of the export side."""
