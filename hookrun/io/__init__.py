"""Files: the captures.h5 layout (one owner), the streaming writer, resume, and the reader."""
