/* Internal to libqtts_ops: the 12 row counts a 12-row register tile is instantiated for, and
 * the table of those instances (a kernel defines DEF_TILE(nt) and names its instances
 * <prefix><kind>_<nt>). */
#pragma once

#define QTTS_DEF_TILES                                                                          \
    DEF_TILE(1)                                                                                 \
    DEF_TILE(2)                                                                                 \
    DEF_TILE(3)                                                                                 \
    DEF_TILE(4)                                                                                 \
    DEF_TILE(5)                                                                                 \
    DEF_TILE(6)                                                                                 \
    DEF_TILE(7)                                                                                 \
    DEF_TILE(8)                                                                                 \
    DEF_TILE(9)                                                                                 \
    DEF_TILE(10)                                                                                \
    DEF_TILE(11)                                                                                \
    DEF_TILE(12)

#define QTTS_TILE_TABLE(prefix, kind)                                                           \
    {0, prefix##kind##_1, prefix##kind##_2, prefix##kind##_3, prefix##kind##_4,                 \
     prefix##kind##_5, prefix##kind##_6, prefix##kind##_7, prefix##kind##_8,                    \
     prefix##kind##_9, prefix##kind##_10, prefix##kind##_11, prefix##kind##_12}
