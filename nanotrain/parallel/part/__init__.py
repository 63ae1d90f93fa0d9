"""This rank's part of a parallelized model and the wrappers a family's plan applies to build it:
``ModelPart``, placement from the meta device, name-keeping adoption, recompute and compile."""
