"""Context parallelism: the sequence split over the `context` mesh axis, in
a causally balanced order (layout.py), and attention across it
(attention.py: all-gather and Ulysses; ring.py: ring attention)."""
