"""The data road, from the original public files to global batches.

`archives` (where original files live, download, verified reading of tar/zip/gzip), `builders`
(the tfds builder base, preparing, padded random-access sources, status lines), `pipeline` (grain
iterators and evaluation batches), `png` (PNG reading and writing), `charlm` (the character
stream and its windows), and the ListOps and Pathfinder generators. Nothing here imports the
models, the attention primitives or the trainer.
"""
