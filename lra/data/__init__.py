"""The data road, from the original public files to global batches.

`archives` (where original files live, download, verified reading of tar/zip/gzip), `builders`
(the tfds builder base, preparing, padded random-access sources, status lines), `pipeline` (grain
iterators and evaluation batches), `png` (PNG reading and writing), one module per task dataset
named after the task (`listops`, `text`, `retrieval`, `image`, `pathfinder`, `charlm` for enwik8
and text8, `sort_marked`: its original files or generator, tfds builder and padded source), and
the ListOps, Pathfinder and sort-marked generators. The Task objects of `lra.tasks` pair these
with their families. Nothing here imports the models, the attention primitives, the tasks or
the trainer.
"""
