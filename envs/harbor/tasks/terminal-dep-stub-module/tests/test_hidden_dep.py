import unittest
import units
from conversions import km_to_miles, miles_to_km

class H(unittest.TestCase):
    def test_conv(self):
        self.assertAlmostEqual(miles_to_km(1), 1.609344)
        self.assertAlmostEqual(km_to_miles(1.609344), 1.0)
        self.assertEqual(units.marathon_miles(), 26.22)
