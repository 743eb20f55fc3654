from setuptools import setup

setup(name="textstats", version="0.2.0", packages=["textstat"])
