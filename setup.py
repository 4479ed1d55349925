"""Build hook for the optional compiled decoders (sbpstream/records/_speedups.pyx, the record
decode loop; sbpstream/protocol/_rangelist.pyx, the LIST_RANGES result reader;
sbpstream/kafka/_transcode.pyx, the Kafka gateway's record conversion).

Everything else is in pyproject.toml. The extension is optional: without a C compiler the build
goes on without it and sbpstream uses its pure-Python decoders (the same results, slower).
"""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # no Cython in the build environment: pure Python only
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension("sbpstream.records._speedups", ["sbpstream/records/_speedups.pyx"],
                   optional=True),
         Extension("sbpstream.protocol._rangelist", ["sbpstream/protocol/_rangelist.pyx"],
                   optional=True),
         Extension("sbpstream.kafka._transcode", ["sbpstream/kafka/_transcode.pyx"],
                   optional=True)],
        compiler_directives={"language_level": "3"},
        quiet=True,
    )
    for ext in ext_modules:  # cythonize rebuilds the Extension objects without the flag
        ext.optional = True

setup(ext_modules=ext_modules)
