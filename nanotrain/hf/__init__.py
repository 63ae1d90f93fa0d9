"""Hugging Face interop: a local Hugging Face model directory read and checked without torch
(``directory``), its weights read into a run's model at any topology (``import_weights``), and a
nanotrain checkpoint written back out as a Hugging Face directory (``export``)."""
